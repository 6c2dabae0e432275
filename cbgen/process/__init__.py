"""What a run keeps and changes in the Python process around it: runtime.py (the process's caches, owned by one
object with `clear()`), changes.py (every temporary change to the process, undone by the scope that made it and
checked), startup.py (starting fast from the command line), quiet.py (other libraries' logging and progress bars,
quietened for a call), shared_patch.py (a process-wide name held by several engines at once)."""

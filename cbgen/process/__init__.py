"""What a run changes in the Python process around it: startup.py (starting fast from the command line),
quiet.py (other libraries' logging and progress bars, quietened for a call), shared_patch.py (a process-wide name
held by several engines at once)."""

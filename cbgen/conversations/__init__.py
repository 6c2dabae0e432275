"""Conversations grown turn by turn (the chat kind, cbgen.kinds.chat): one row in, one conversation out.

    state.py     a conversation: its opening, its turns, what comes next (a reply, a user turn) and how it ended
    builder.py   a turn's request: the conversation so far in the chat template, earlier replies as their own tokens
    journal.py   finished turns kept beside the shards, so that a resume continues each conversation where it was
    driver.py    the loop: every open conversation's next turn fed to the engine as the one before it finishes
    rows.py      a finished conversation as an output row

Turns of many conversations run together in one engine, and a conversation's next turn is handed to it as soon as its
last one finishes, so turn k + 1 finds turn k's prompt and reply still in the KV cache's shared blocks: only its new
user message is computed.
"""

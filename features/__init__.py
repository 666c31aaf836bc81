"""The optional parts of the toolkit, one module per idea, out of the reader's way.

grpo_ref_split.py (the lesson) and ref_server.py meet each of them in one line. A module takes the
constants it needs as arguments: none imports the trainer, and what the server uses imports
neither the trainer nor rewards.py.
"""

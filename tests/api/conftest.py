"""Fixtures shared by the API tests: `chat_model` (tests/api/chatkit.py) for every module
here, so a test names it as a parameter without importing it."""

from tests.api.chatkit import chat_model  # noqa: F401  re-exported: pytest finds it here

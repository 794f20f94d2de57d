"""The Textual chat UI (installed as edgespec.tui). The core never imports it."""

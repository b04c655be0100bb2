"""The Wyoming listener (docs/home-assistant.md, "Voice (Assist)"): Home Assistant's voice commands as
jobs of the queue."""

"""What both planes agree on: bearer auth, the error-to-status rule, the log format, the name rule,
default ports and limits, and where lorafleet keeps its data. Torch-free and import-light."""

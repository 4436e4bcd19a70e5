"""What both planes agree on: bearer auth, the error-to-status rule, the log format, the name rule,
default ports and limits, health service names, how a server process exits, and where lorafleet
keeps its data. Torch-free and import-light."""

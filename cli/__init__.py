"""The `lorafleet` command line: clients of both planes, and `lorafleet up`."""

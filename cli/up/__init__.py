"""`lorafleet up`: the whole stack on this machine, as supervised child processes."""

"""The clients' front door: ``lorafleet router`` serves ``Generation/Generate`` unchanged and sends each
request to the pod where its adapter already lives, chosen from live fleet state. It talks to both planes
over gRPC only and holds no state of its own beyond a cache of theirs."""

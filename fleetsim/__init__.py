"""A discrete-event simulator of a lorafleet fleet: hundreds of pods and thousands of adapters, minutes of
traffic in seconds of wall time, driving the real placement (``control_plane.placement``), plan
(``control_plane.plan``) and router picker (``router.picker``) next to the peers' policies."""

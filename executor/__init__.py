"""The lattice around one engine: engine client interface, engine loop, the server's HTTP layer."""

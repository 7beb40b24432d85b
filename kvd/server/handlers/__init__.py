"""KvdService's handlers, by concern (see kvd.server.service)."""

"""The daemon's data planes: where bytes move between tiers and engines.

  disk.py         the disk plane: the I/O thread that owns the DiskTier,
                  write-back rounds (kvd.core.mover), Get reads
                  (kvd.core.get_life), durable waits, prefetch
  io_executor.py  that I/O thread and the schedule it runs jobs in
  device.py       the device plane: engines' KV pools registered, kvd-driven
                  per-layer saves and loads on their streams
  device_tier.py  the device tier: copies kept in GPU memory after a save

The gRPC edge (kvd.server) calls into a plane; a plane drives the core
(kvd.core) and the tiers (kvd.tiers); nothing here speaks protobuf.
"""

"""The daemon's data planes: where bytes move between tiers and engines.

  disk.py         the disk plane: the I/O thread that owns the DiskTier,
                  open, recovery, start and close; its writes (write-back
                  rounds of kvd.core.mover, commits, durable waits) in
                  disk_writes.py and its reads (Gets' loads for
                  kvd.core.get_life, prefetch) in disk_reads.py
  io_executor.py  that I/O thread and the schedule it runs jobs in
  device.py       the device plane: engines' KV pools registered, kvd-driven
                  per-layer saves and loads on their streams
  device_tier.py  the device tier: copies kept in GPU memory after a save

The gRPC edge (kvd.server) calls into a plane; a plane drives the core
(kvd.core) and the tiers (kvd.tiers); nothing here speaks protobuf.
"""

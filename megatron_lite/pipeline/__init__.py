"""Pipeline parallelism: `partition` (layers -> virtual stages -> rank chunks), `schedules` (each rank's
ordered computations and messages as plain data), `simulate` (runs every rank's list together in one
process to check it and measure the bubble), `executor` (runs one rank's list with torch.distributed).

The first three are pure Python and import no torch, so tools and unit tests use them freely."""

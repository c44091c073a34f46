-- KvIndex.overlaps, after index_functions.lua, overlaps_functions.lua and the line that makes
-- `kv_overlaps` the index's variant (routing.kv.index.overlaps_choice).
-- ARGV: ns, packed hashes, worker... -> each worker's overlap in blocks, in order
return kv_overlaps(ARGV[1], ARGV[2], {unpack(ARGV, 3)})

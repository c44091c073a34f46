-- KvIndex.purge_worker, after index_functions.lua. ARGV: ns, worker -> blocks dropped
return kv_purge(ARGV[1], ARGV[2])

-- KvIndex.prefix_holders, after index_functions.lua and overlaps_functions.lua.
-- ARGV: ns, packed hashes, cap per level -> names (repeats possible), deepest prefixes first
return kv_prefix_holders(ARGV[1], ARGV[2], tonumber(ARGV[3]))

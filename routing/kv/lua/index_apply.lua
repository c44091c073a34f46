-- KvIndex.apply_many, after index_functions.lua.
-- ARGV: ns, then (kind, worker, packed hashes) per event
local ns = ARGV[1]
for i = 2, #ARGV, 3 do
  local err = kv_apply(ns, ARGV[i], ARGV[i + 1], ARGV[i + 2])
  if err then return err end
end
return 0

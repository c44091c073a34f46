-- KvEventPublisher.publish (routing.kv.events), after index_functions.lua: the events are applied
-- to the index and appended to the stream in one atomic call.
-- ARGV: ns, maxlen, then (kind, worker, packed hashes, event json) per event
local ns = ARGV[1]
local maxlen = ARGV[2]
local ids = {}
for i = 3, #ARGV, 4 do
  local kind, worker = ARGV[i], ARGV[i + 1]
  local err = kv_apply(ns, kind, worker, ARGV[i + 2])
  if err then return err end
  ids[#ids + 1] = kv_append_event(ns, maxlen, worker, ARGV[i + 3])
end
return ids

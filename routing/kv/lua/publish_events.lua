-- KvEventPublisher.publish (routing.kv.events), after index_functions.lua: the events are applied
-- to the index and appended to the stream in one atomic call. EVENTS_STREAM and EVENT_IDS_KEY are
-- locals routing.kv.events puts in front.
-- ARGV: ns, maxlen, then (kind, worker, packed hashes, event json) per event
local ns = ARGV[1]
local stream = ns .. EVENTS_STREAM
local ids_key = ns .. EVENT_IDS_KEY
local maxlen = ARGV[2]
local ids = {}
for i = 3, #ARGV, 4 do
  local kind, worker = ARGV[i], ARGV[i + 1]
  local err = kv_apply(ns, kind, worker, ARGV[i + 2])
  if err then return err end
  local event_id = redis.call('HINCRBY', ids_key, worker, 1)
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*',
    'worker', worker, 'event_id', event_id, 'event', ARGV[i + 3])
  ids[#ids + 1] = event_id
end
return ids

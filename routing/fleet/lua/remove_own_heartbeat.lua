-- WorkerRegistry.remove (routing.fleet.registry): deletes the heartbeat only if it is the given
-- instance's, so a process that shuts down after a successor took its name does not deregister
-- the successor. KEYS: the heartbeat. ARGV: the instance ('': whoever's it is) -> keys deleted
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, beat = pcall(cjson.decode, raw)
if ARGV[1] ~= '' and ok and type(beat) == 'table' and beat['instance'] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])

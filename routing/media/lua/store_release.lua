-- MediaStore.release (routing.media.store).
-- KEYS: sizes, total, owner, then the blob keys. ARGV: each blob's `<key>|<bytes>` member, in order.
-- Frees what is still counted (a second release, or one after the sweep, frees nothing twice).
local freed = 0
for i, member in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[1], member) == 1 then
    freed = freed + tonumber(string.match(member, '|(%d+)$'))
  end
  redis.call('DEL', KEYS[i + 3])
end
if freed > 0 then
  local left = redis.call('DECRBY', KEYS[2], freed)
  if left < 0 then redis.call('SET', KEYS[2], 0) end
end
redis.call('DEL', KEYS[3])
return freed

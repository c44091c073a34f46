-- KvIndex.candidates, after index_functions.lua and overlaps_functions.lua.
-- ARGV: ns, packed hashes, cap per level, the sampled names joined by newlines, the session's
-- affinity key or '' (its worker joins the sample) -> {names, their overlaps as big-endian i32s}
local sample = {}
for name in string.gmatch(ARGV[4], '[^\n]+') do sample[#sample + 1] = name end
if ARGV[5] ~= '' then
  local sticky = redis.call('GET', ARGV[5])
  if sticky then sample[#sample + 1] = sticky end
end
return kv_candidates(ARGV[1], ARGV[2], tonumber(ARGV[3]), sample)

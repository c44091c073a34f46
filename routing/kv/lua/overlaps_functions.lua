-- The overlap query (routing.kv.index), in two variants; composed in front of the index's overlap
-- script and the router's decision after index_functions.lua, whose server_time_ms it calls.
-- Both look for approximate blocks only for workers listed in `kv:approximate` (one SMISMEMBER).
local function kv_overlap_probe(ns, packed, workers)
  local approximate = {}
  local any_approximate = false
  local now = 0
  if #packed > 0 and #workers > 0 then
    local flags = redis.call('SMISMEMBER', ns .. APPROXIMATE_KEY, unpack(workers))
    for j, worker in ipairs(workers) do
      if flags[j] == 1 then
        approximate[worker] = ns .. APPROXIMATE_FAMILY .. worker
        any_approximate = true
      end
    end
    if any_approximate then now = server_time_ms() end
  end
  -- Splits a group into the workers that hold block b and the others, in one HMGET.
  return function(b, group)
    local h = string.sub(packed, b * 8 - 7, b * 8)
    local held = redis.call('HMGET', ns .. BLOCK_FAMILY .. h, unpack(group))
    local yes, no = {}, {}
    for j, worker in ipairs(group) do
      local holds = held[j]
      if not holds and any_approximate and approximate[worker] then
        local expiry = redis.call('ZSCORE', approximate[worker], h)
        holds = expiry and tonumber(expiry) > now
      end
      if holds then yes[#yes + 1] = worker else no[#no + 1] = worker end
    end
    return yes, no
  end
end

-- Numeric loops rather than ipairs on the per-worker passes: ipairs is a function call per
-- element in Redis's Lua 5.1, and these run on every routing decision.
local function kv_overlap_list(workers, overlap)
  local out = {}
  for i = 1, #workers do out[i] = overlap[workers[i]] or 0 end
  return out
end

-- Exact walk, block by block in prompt order, asking only the workers that matched every
-- block so far and stopping when none is left. Cost: the sum over blocks of workers alive.
-- `position` goes unused: it is in the signature because the decision script calls whichever
-- variant the index uses with the same arguments, and the bisect one reads it.
local function kv_overlaps_linear(ns, packed, workers, position)
  local holders = kv_overlap_probe(ns, packed, workers)
  local overlap = {}
  local alive = workers
  for b = 1, #packed / 8 do
    if #alive == 0 then break end
    local yes = holders(b, alive)
    for _, worker in ipairs(yes) do overlap[worker] = b end
    alive = yes
  end
  return kv_overlap_list(workers, overlap)
end

-- Change points of the holder count. When every worker's blocks are prefix-closed (holding
-- block b means holding every block before it), the holders of the request's blocks are
-- nested, shrinking sets, so equal HLENs at two blocks mean the same holders at every block
-- between them. Bisecting on HLEN (O(1) each) finds the blocks after which some workers drop
-- out, about (distinct overlaps) x log2(blocks) calls whatever the number of workers; reading
-- the holders of those blocks alone, deepest first, gives each worker its overlap. A prefix
-- cache that evicts leaves first (ours, vLLM's, SGLang's) keeps its blocks prefix-closed:
-- sequence hashes chain, so a block is never cached without the prefix it extends.
-- Approximate records are searched per worker (they are a prefix too: a route refreshes the
-- whole chain it records), and a worker's overlap is the larger of the two.
--
-- kv_change_points: the blocks b of the request after which some holders drop out (the holders of b are not
-- all holders of b + 1; the last block if anyone holds it), deepest first: about (distinct
-- overlaps) x log2(blocks) HLENs, whatever the number of workers. Nothing when nobody holds
-- the first block.
local function kv_change_points(ns, packed)
  local n = #packed / 8
  local prefix, sub, call = ns .. BLOCK_FAMILY, string.sub, redis.call
  local function count(b) return call('HLEN', prefix .. sub(packed, b * 8 - 7, b * 8)) end
  local changes = {}
  if n == 0 then return changes end
  local first = count(1)
  if first == 0 then return changes end
  local last = count(n)
  if last > 0 then changes[1] = n end
  -- Segments still to search (from, its count, to, its count), as four stacks: no table
  -- per segment.
  local los, clos, his, chis, top = {1}, {first}, {n}, {last}, 1
  while top > 0 do
    local lo, clo, hi, chi = los[top], clos[top], his[top], chis[top]
    top = top - 1
    if clo ~= chi then
      if hi == lo + 1 then
        changes[#changes + 1] = lo
      else
        local mid = math.floor((lo + hi) / 2)
        local cmid = count(mid)
        los[top + 1], clos[top + 1], his[top + 1], chis[top + 1] = lo, clo, mid, cmid
        los[top + 2], clos[top + 2], his[top + 2], chis[top + 2] = mid, cmid, hi, chi
        top = top + 2
      end
    end
  end
  table.sort(changes, function(a, b) return a > b end)
  return changes
end

local function kv_overlaps_bisect(ns, packed, workers, position)
  local n, m = #packed / 8, #workers
  -- Overlaps by the workers' positions (0: none yet); `position` maps a name to its place, made
  -- here unless the caller has one (the decision script does). Names are distinct.
  if not position then
    position = {}
    for i = 1, m do position[workers[i]] = i end
  end
  local out = {}
  for i = 1, m do out[i] = 0 end
  local unassigned = m
  if unassigned > 0 then
    local changes = kv_change_points(ns, packed)
    local prefix, sub, call = ns .. BLOCK_FAMILY, string.sub, redis.call
    for k = 1, #changes do
      local b = changes[k]
      local key = prefix .. sub(packed, b * 8 - 7, b * 8)
      if call('HLEN', key) > unassigned then
        -- More hold it than are still asked about (a shared system prompt on a large fleet):
        -- ask about those alone, so the cost follows the workers asked, not the holders.
        local asked = {}
        for i = 1, m do
          if out[i] == 0 then asked[#asked + 1] = i end
        end
        local names = {}
        for a = 1, #asked do names[a] = workers[asked[a]] end
        local held = call('HMGET', key, unpack(names))
        for a = 1, #asked do
          if held[a] then
            out[asked[a]] = b
            unassigned = unassigned - 1
          end
        end
      else
        local holders = call('HKEYS', key)
        for i = 1, #holders do
          local j = position[holders[i]]
          if j and out[j] == 0 then
            out[j] = b
            unassigned = unassigned - 1
          end
        end
      end
      if unassigned == 0 then break end
    end
  end
  if n > 0 and m > 0 and redis.call('EXISTS', ns .. APPROXIMATE_KEY) == 1 then
    local flags = redis.call('SMISMEMBER', ns .. APPROXIMATE_KEY, unpack(workers))
    local now = nil
    for j = 1, m do
      if flags[j] == 1 then
        now = now or server_time_ms()
        local key = ns .. APPROXIMATE_FAMILY .. workers[j]
        local function held(b)
          local expiry = redis.call('ZSCORE', key, string.sub(packed, b * 8 - 7, b * 8))
          return expiry and tonumber(expiry) > now
        end
        local best = out[j]
        if best < n and held(best + 1) then
          -- Largest k with block k held: the last block first, then bisection.
          local lo, hi = best + 1, n
          if held(hi) then lo = hi end
          while lo < hi do
            local mid = math.floor((lo + hi + 1) / 2)
            if held(mid) then lo = mid else hi = mid - 1 end
          end
          out[j] = lo
        end
      end
    end
  end
  return out
end

-- A bounded set of the workers that hold the request's longest cached prefixes: at each change
-- point, deepest first, its holders (at most `cap` of them, drawn at random where more hold it:
-- they hold the same prefix, and the decision weighs them by load alone), and the workers the
-- router sent a prompt sharing this one's prefix to within the predicted TTL (their `kv:pred:`
-- marks, one per PREDICTED_STRIDE blocks; see kv_predict). What the decision reads whatever
-- the number of workers: about levels x cap names.
local function kv_prefix_holders(ns, packed, cap)
  local prefix, sub, call = ns .. BLOCK_FAMILY, string.sub, redis.call
  local out = {}
  local changes = kv_change_points(ns, packed)
  for k = 1, #changes do
    local key = prefix .. sub(packed, changes[k] * 8 - 7, changes[k] * 8)
    local names
    if call('HLEN', key) <= cap then names = call('HKEYS', key) else names = call('HRANDFIELD', key, cap) end
    for i = 1, #names do out[#out + 1] = names[i] end
  end
  local n = #packed / 8
  if n > 0 then
    local marks = {}
    local stride = tonumber(PREDICTED_STRIDE)
    for b = stride, n, stride do
      marks[#marks + 1] = ns .. PREDICTED_FAMILY .. sub(packed, b * 8 - 7, b * 8)
    end
    if #marks > 0 then
      local routed = call('MGET', unpack(marks))
      for i = 1, #routed do
        if routed[i] then out[#out + 1] = routed[i] end
      end
    end
  end
  return out
end

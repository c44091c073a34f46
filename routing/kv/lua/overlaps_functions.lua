-- The overlap query (routing.kv.index), in two variants; composed in front of the index's overlap
-- script and the router's decision after index_functions.lua, whose server_time_ms it calls.
-- Both look for approximate blocks only for workers listed in `kv:approximate` (one SMISMEMBER).
-- A block's holders are a string of 2-byte worker ids (kv_holders); the names asked about are
-- turned into ids with one HMGET, and only the names of holders a draw meets are looked up.
local function kv_overlap_probe(ns, packed, workers)
  local approximate = {}
  local any_approximate = false
  local now = 0
  local idof = {}
  if #packed > 0 and #workers > 0 then
    local flags = redis.call('SMISMEMBER', ns .. APPROXIMATE_KEY, unpack(workers))
    for j, worker in ipairs(workers) do
      if flags[j] == 1 then
        approximate[worker] = ns .. APPROXIMATE_FAMILY .. worker
        any_approximate = true
      end
    end
    if any_approximate then now = server_time_ms() end
    local ids = kv_hmget(ns .. WORKER_IDS_KEY, workers)
    for j = 1, #workers do idof[workers[j]] = ids[j] end
  end
  -- Splits a group into the workers that hold block b and the others, from one holder string.
  return function(b, group)
    local h = string.sub(packed, b * 8 - 7, b * 8)
    local held = kv_holders(ns, h)
    local yes, no = {}, {}
    for j, worker in ipairs(group) do
      local id = idof[worker]
      local holds = id and kv_id_at(held, id)
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

-- The approximate workers among `workers` (those in `kv:approximate`): each one's overlap in
-- `out` (by position) raised to its approximate records' longest prefix, searched per worker
-- (a route records a whole chain, so they are a prefix too).
local function kv_approximate_overlaps(ns, packed, workers, out)
  local n, m = #packed / 8, #workers
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
end

-- One worker's overlap from the index, by bisection over the request's blocks (its blocks are
-- prefix-closed, kv_change_points says why): about log2(blocks) bucket reads. For a worker a
-- decision among given candidates weighs without being given its overlap (the session's).
local function kv_worker_overlap(ns, packed, worker)
  local n = #packed / 8
  local id = redis.call('HGET', ns .. WORKER_IDS_KEY, worker)
  if not id or n == 0 then return 0 end
  local sub = string.sub
  local function held(b) return kv_id_at((kv_holders(ns, sub(packed, b * 8 - 7, b * 8))), id) ~= nil end
  if not held(1) then return 0 end
  if held(n) then return n end
  local lo, hi = 1, n - 1  -- block lo is held, block hi + 1 is not
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if held(mid) then lo = mid else hi = mid - 1 end
  end
  return lo
end

-- Each worker's overlap in `out` (by `position`, a name's place) raised to what the predicted
-- marks on the request's blocks credit it with (kv_predicted_marks).
local function kv_marked_overlaps(ns, packed, position, out)
  for _, mark in ipairs(kv_predicted_marks(ns, packed)) do
    local j = position[mark[2]]
    if j and out[j] < mark[1] then out[j] = mark[1] end
  end
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
  local out = kv_overlap_list(workers, overlap)
  if not position then
    position = {}
    for i = 1, #workers do position[workers[i]] = i end
  end
  kv_marked_overlaps(ns, packed, position, out)
  return out
end

-- Change points of the holder count. When every worker's blocks are prefix-closed (holding
-- block b means holding every block before it), the holders of the request's blocks are
-- nested, shrinking sets, so equal holder counts at two blocks mean the same holders at every
-- block between them. Bisecting on the count (one HGET of a bucket field each, kv_holder_count)
-- finds the blocks after which some workers drop
-- out, about (distinct overlaps) x log2(blocks) calls whatever the number of workers; reading
-- the holders of those blocks alone, deepest first, gives each worker its overlap. A prefix
-- cache that evicts leaves first (ours, vLLM's, SGLang's) keeps its blocks prefix-closed:
-- sequence hashes chain, so a block is never cached without the prefix it extends.
-- Approximate records are searched per worker (they are a prefix too: a route refreshes the
-- whole chain it records), and a worker's overlap is the larger of the two.
--
-- kv_change_points: the blocks b of the request after which some holders drop out (the holders of b are not
-- all holders of b + 1; the last block if anyone holds it), deepest first: about (distinct
-- overlaps) x log2(blocks) counts, whatever the number of workers. Nothing when nobody holds
-- the first block.
local function kv_change_points(ns, packed)
  local n = #packed / 8
  local sub = string.sub
  local function count(b) return kv_holder_count(ns, sub(packed, b * 8 - 7, b * 8)) end
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
  if unassigned > 0 and n > 0 then
    local changes = kv_change_points(ns, packed)
    -- Each asked worker's position by its id as a number (first * 256 + second byte): a holder
    -- string is read with string.byte, which makes no Lua string per holder as string.sub would.
    local ids, at_id = {}, {}
    if #changes > 0 then
      -- Workers that never stored a block have no id: they hold nothing.
      ids = kv_hmget(ns .. WORKER_IDS_KEY, workers)
      local byte = string.byte
      for i = 1, m do
        local id = ids[i]
        if id then
          local hi, lo = byte(id, 1, 2)
          at_id[hi * 256 + lo] = i
        else
          out[i], unassigned = -1, unassigned - 1
        end
      end
    end
    local sub, byte = string.sub, string.byte
    for k = 1, #changes do
      if unassigned == 0 then break end
      local b = changes[k]
      local holders = kv_holders(ns, sub(packed, b * 8 - 7, b * 8))
      if #holders / 2 > 4 * unassigned then
        -- Many more hold it than are still asked about (a shared system prompt on a large
        -- fleet): look for those alone, so the cost follows the workers asked, not the holders.
        -- (A search is a call; a holder read in the loop below, a few times cheaper.)
        for i = 1, m do
          if out[i] == 0 and kv_id_at(holders, ids[i]) then
            out[i] = b
            unassigned = unassigned - 1
          end
        end
      else
        for at = 1, #holders, 2 do
          local hi, lo = byte(holders, at, at + 1)
          local j = at_id[hi * 256 + lo]
          if j and out[j] == 0 then
            out[j] = b
            unassigned = unassigned - 1
          end
        end
      end
    end
    for i = 1, m do
      if out[i] < 0 then out[i] = 0 end
    end
  end
  kv_approximate_overlaps(ns, packed, workers, out)
  kv_marked_overlaps(ns, packed, position, out)
  return out
end

-- The workers a decision over a large fleet weighs, each with its overlap: at each change point
-- of the request, deepest first, its holders (at most `cap`, drawn at random where more hold it:
-- they hold the same prefix, and the decision weighs them by load alone); the workers of
-- `sample` (drawn by the caller from the whole fleet: the least loaded of them stands for the
-- workers that hold nothing); and those the predicted marks name (a sibling prompt just sent
-- there). About levels x cap names whatever the number of workers, and their overlaps exact:
-- a name first met at a shallow change point is asked about the deeper ones whose holders were
-- drawn, not all read. Returns the names and their overlaps, two lists in one order.
local function kv_candidate_overlaps(ns, packed, cap, sample)
  local sub = string.sub
  local names, out, position = {}, {}, {}
  local function add(name, b)
    local j = position[name]
    if not j then
      j = #names + 1
      names[j], out[j], position[name] = name, b, j
    elseif out[j] < b then
      out[j] = b
    end
    return j
  end
  local idof, nameof, held_at = {}, {}, {}
  local function holders_of(b)
    local held = held_at[b]
    if not held then
      held = kv_holders(ns, sub(packed, b * 8 - 7, b * 8))
      held_at[b] = held
    end
    return held
  end
  -- Asks about `asking` at the blocks `levels` (deepest first), each at the deepest it holds;
  -- returns those that hold none of them.
  local function ask_at(levels, asking)
    for k = 1, #levels do
      if #asking == 0 then break end
      local b = levels[k]
      local held = holders_of(b)
      local rest = {}
      for i = 1, #asking do
        local id = idof[asking[i]]
        if id and kv_id_at(held, id) then add(asking[i], b) else rest[#rest + 1] = asking[i] end
      end
      asking = rest
    end
    return asking
  end
  local changes = kv_change_points(ns, packed)
  local drawn = {}  -- the deeper change points whose holders were drawn, not all read
  -- Where a draw starts in a long holder string: the server clock's microseconds, so draws
  -- differ from one decision to the next (Lua's math.random restarts from one seed per script).
  local start = #changes > 0 and tonumber(redis.call('TIME')[2]) or 0
  for k = 1, #changes do
    local b = changes[k]
    local held = holders_of(b)
    local count = #held / 2
    local partial = count > cap
    local ids = {}
    if partial then
      -- `cap` holders spread evenly over the string from a moving start.
      for i = 0, cap - 1 do
        local at = (start + math.floor(i * count / cap)) % count
        ids[#ids + 1] = sub(held, at * 2 + 1, at * 2 + 2)
      end
    else
      for at = 1, #held, 2 do ids[#ids + 1] = sub(held, at, at + 1) end
    end
    local unknown = {}
    for i = 1, #ids do
      if not nameof[ids[i]] then unknown[#unknown + 1] = ids[i] end
    end
    if #unknown > 0 then
      local found = kv_hmget(ns .. WORKER_NAMES_KEY, unknown)
      for i = 1, #unknown do
        if found[i] then nameof[unknown[i]], idof[found[i]] = found[i], unknown[i] end
      end
    end
    local met = {}
    for i = 1, #ids do
      local name = nameof[ids[i]]
      if name then
        if not position[name] then met[#met + 1] = name end
        add(name, b)
      end
    end
    -- Newcomers may hold a deeper drawn level too: ask there, deepest first.
    ask_at(drawn, met)
    if partial then drawn[#drawn + 1] = b end
  end
  local asked = {}
  for i = 1, #sample do
    if not position[sample[i]] then asked[#asked + 1] = sample[i] end
  end
  if #changes > 0 and #asked > 0 then
    local ids = kv_hmget(ns .. WORKER_IDS_KEY, asked)
    for i = 1, #asked do
      if ids[i] then idof[asked[i]] = ids[i] end
    end
  end
  for _, name in ipairs(ask_at(changes, asked)) do add(name, 0) end
  for _, mark in ipairs(kv_predicted_marks(ns, packed)) do add(mark[2], mark[1]) end
  kv_approximate_overlaps(ns, packed, names, out)
  return names, out
end

-- kv_candidate_overlaps as a reply: {names, their overlaps as big-endian i32s}.
local function kv_candidates(ns, packed, cap, sample)
  local names, out = kv_candidate_overlaps(ns, packed, cap, sample)
  if #out == 0 then return {names, ''} end
  return {names, struct.pack('>' .. string.rep('i4', #out), unpack(out))}
end

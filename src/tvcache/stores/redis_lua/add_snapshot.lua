-- ARGV: prefix, origin, budget, snapshot id, path nodes (root first; the snapshot is at the last).
-- Returns the snapshot ids to delete. Eviction follows tvcache.stores.eviction.choose_evictions: never a leased one,
-- leaves before inner snapshots, least recently used first, the one just added last.
local origin, budget, id, node = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[#ARGV]
local snap, parent, used, lease = keys_of(origin)
if redis.call('HEXISTS', snap, node) == 1 then return {id} end
local above = false
for i = #ARGV - 1, 5, -1 do
  if redis.call('HEXISTS', snap, ARGV[i]) == 1 then above = ARGV[i] break end
end
local now = clock()
redis.call('HSET', snap, node, id)
if above then redis.call('HSET', parent, node, above) end
redis.call('ZADD', used, now, node)
redis.call('SADD', KEYS[1], origin)
local excess = redis.call('HLEN', snap) - budget
if excess <= 0 then return {} end

redis.call('ZREMRANGEBYSCORE', lease, '-inf', now)
local leased = leased_nodes(lease, now)
local inner = {}
for _, p in ipairs(redis.call('HVALS', parent)) do inner[p] = true end
local lru = redis.call('ZRANGE', used, 0, -1)
local doomed = {}
local function pick(want_inner)
  for _, n in ipairs(lru) do
    if #doomed < excess and n ~= node and not leased[n] and (inner[n] == true) == want_inner then
      doomed[#doomed + 1] = n
    end
  end
end
pick(false)
pick(true)
if #doomed < excess and not leased[node] then doomed[#doomed + 1] = node end

local ids = {}
for _, n in ipairs(doomed) do
  ids[#ids + 1] = redis.call('HGET', snap, n)
  redis.call('HDEL', snap, n)
  redis.call('HDEL', parent, n)
  redis.call('ZREM', used, n)
end
if redis.call('HLEN', snap) == 0 then redis.call('SREM', KEYS[1], origin) end
return ids

-- The snapshot scripts take KEYS[1] = the scope's origins set and ARGV[1] = the scope's key prefix, and name
-- an origin's keys here, in one place. Those names carry the scope's hash tag, so they live in KEYS[1]'s
-- slot: Redis Cluster lets a script use undeclared keys of the slot it runs in.
local function keys_of(origin)
  local p = ARGV[1]
  return p .. 'snap:' .. origin, p .. 'parent:' .. origin, p .. 'used:' .. origin, p .. 'lease:' .. origin
end

local function leased_nodes(lease, now)
  local nodes = {}
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', lease, string.format('(%.17g', now), '+inf')) do
    nodes[string.sub(m, 1, 16)] = true
  end
  return nodes
end

-- Rows of {origin, node, snapshot id, parent or '', last used, leased 0/1}, appended to `out`.
local function records(origin, now, out)
  local snap, parent, used, lease = keys_of(origin)
  local leased = leased_nodes(lease, now)
  local ranked = redis.call('ZRANGE', used, 0, -1, 'WITHSCORES')
  for i = 1, #ranked, 2 do
    local node = ranked[i]
    out[#out + 1] = {
      origin, node, redis.call('HGET', snap, node), redis.call('HGET', parent, node) or '', ranked[i + 1],
      leased[node] and 1 or 0,
    }
  end
  return out
end

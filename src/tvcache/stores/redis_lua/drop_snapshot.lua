-- ARGV: prefix, origin, node, snapshot id. Forgets the snapshot and any lease on it.
local origin, node = ARGV[2], ARGV[3]
local snap, parent, used, lease = keys_of(origin)
if redis.call('HGET', snap, node) ~= ARGV[4] then return 0 end
redis.call('HDEL', snap, node)
redis.call('HDEL', parent, node)
redis.call('ZREM', used, node)
for _, m in ipairs(redis.call('ZRANGE', lease, 0, -1)) do
  if string.sub(m, 1, 16) == node then redis.call('ZREM', lease, m) end
end
if redis.call('HLEN', snap) == 0 then redis.call('SREM', KEYS[1], origin) end
return 1

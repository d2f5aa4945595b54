-- ARGV: prefix, origin, ttl seconds, nonce, path nodes (root first). Returns {node, snapshot id} or nil.
local snap, _, used, lease = keys_of(ARGV[2])
for i = #ARGV, 5, -1 do
  local node = ARGV[i]
  local id = redis.call('HGET', snap, node)
  if id then
    local now = clock()
    redis.call('ZREMRANGEBYSCORE', lease, '-inf', now)
    redis.call('ZADD', lease, now + tonumber(ARGV[3]), node .. ARGV[4])
    redis.call('ZADD', used, now, node)
    return {node, id}
  end
end
return false

-- ARGV: prefix, origin, lease member.
local _, _, _, lease = keys_of(ARGV[2])
redis.call('ZREM', lease, ARGV[3])
return 0

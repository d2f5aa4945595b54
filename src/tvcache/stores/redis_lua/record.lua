-- KEYS: entries, claim, waiters, wake. ARGV: field, entry, wake seconds.
-- Returns nil if `entry` was stored, else the entry that was there first. Ends the claim whoever holds it:
-- with an entry recorded, nobody needs to execute the call any more.
local stored = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1
redis.call('DEL', KEYS[2])
wake(KEYS[3], KEYS[4])
if stored then return false end
return redis.call('HGET', KEYS[1], ARGV[1])

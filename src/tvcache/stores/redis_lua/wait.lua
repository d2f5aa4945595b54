-- KEYS: entries, claim, waiters. ARGV: field.
-- Returns the entry, nil when no claim is held (released or expired), else the claim's milliseconds left,
-- having registered the caller as a waiter to wake.
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if entry then return entry end
local left = redis.call('PTTL', KEYS[2])
if left < 0 then return false end
redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], left + 1000 * tonumber(ARGV[2]))
return left

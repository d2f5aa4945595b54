-- KEYS: the call's candidate list, the scope's set of candidate lists. ARGV: candidate, how many to keep.
-- Puts the candidate first (an identical one moves there) and drops the oldest past the limit.
redis.call('LREM', KEYS[1], 0, ARGV[1])
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
redis.call('SADD', KEYS[2], KEYS[1])
return 0

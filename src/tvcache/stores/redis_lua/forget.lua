-- KEYS: origins, entries, hits, candidate lists. ARGV: prefix. Deletes the scope's graph (claims and wake lists
-- expire).
for _, origin in ipairs(redis.call('SMEMBERS', KEYS[1])) do redis.call('DEL', keys_of(origin)) end
for _, list in ipairs(redis.call('SMEMBERS', KEYS[4])) do redis.call('DEL', list) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return 0

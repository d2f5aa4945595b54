-- KEYS: origins, entries, hits. ARGV: prefix. Deletes the scope's graph (claims and wake lists expire).
for _, origin in ipairs(redis.call('SMEMBERS', KEYS[1])) do redis.call('DEL', keys_of(origin)) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 0

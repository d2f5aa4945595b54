"""A service that starts from config.json (see README.md)."""

import json
import sys

REQUIRED = {
    "server": {"host": str, "port": int, "workers": int, "debug": bool},
    "database": {"url": str, "pool_size": int, "timeout": float},
    "cache": {"enabled": bool, "ttl": int},
}


def load(path="config.json"):
    with open(path) as f:
        config = json.load(f)
    for section, keys in REQUIRED.items():
        if section not in config:
            raise SystemExit(f"config: missing section {section!r}")
        for key, kind in keys.items():
            value = config[section].get(key)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise SystemExit(f"config: {section}.{key} must be {kind.__name__}, got {value!r}")
    return config


if __name__ == "__main__":
    config = load()
    if "--check" in sys.argv:
        print("config ok")
    else:
        print(f"serving on {config['server']['host']}:{config['server']['port']}")

import json
import os
import unittest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TestConfig(unittest.TestCase):
    def setUp(self):
        with open(os.path.join(HERE, "config.json")) as f:
            self.config = json.load(f)

    def test_server(self):
        self.assertEqual(self.config["server"], {"host": "0.0.0.0", "port": 8080, "workers": 4, "debug": False})

    def test_database(self):
        self.assertEqual(self.config["database"]["pool_size"], 10)
        self.assertEqual(self.config["database"]["timeout"], 2.5)

    def test_cache(self):
        self.assertEqual(self.config["cache"], {"enabled": True, "ttl": 300})


if __name__ == "__main__":
    unittest.main()

import unittest

from statskit import mean, median, mode, quantile, stdev, variance


class TestCentral(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_median_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)

    def test_median_even(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_mode_ties_pick_smallest(self):
        self.assertEqual(mode([3, 3, 1, 1, 2]), 1)

    def test_empty(self):
        with self.assertRaises(ValueError):
            median([])


class TestSpread(unittest.TestCase):
    def test_sample_variance(self):
        self.assertAlmostEqual(variance([2, 4, 4, 4, 5, 5, 7, 9]), 4.571428571428571)

    def test_population_variance(self):
        self.assertAlmostEqual(variance([2, 4, 4, 4, 5, 5, 7, 9], sample=False), 4.0)

    def test_stdev(self):
        self.assertAlmostEqual(stdev([2, 4, 4, 4, 5, 5, 7, 9], sample=False), 2.0)

    def test_quantile(self):
        self.assertEqual(quantile([1, 2, 3, 4, 5], 0.25), 2)


if __name__ == "__main__":
    unittest.main()

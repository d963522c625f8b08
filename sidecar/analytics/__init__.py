"""WAL analytics on Spark: decode archived WAL into Parquet datasets, statistics, an HTML report, archive checks.

Needs the `analytics` extra (pyspark, pyarrow, matplotlib, lz4, zstandard). Only the analytics
commands import this package, so the safekeeper and proposer never load Spark.
"""

"""The S3 tier of the store: entries in an S3-compatible bucket (``s3://bucket/prefix``).

`parse_s3_url` reads a URL into an `S3Address`; `S3Tier` moves framed entries; `calls` bounds
every call by a deadline and skips a bucket that stopped answering. boto3 is imported only when
a tier is opened (``pip install 'kamera-agent[s3]'``).
"""

from kamera_agent.store.s3.address import S3Address, parse_s3_url
from kamera_agent.store.s3.tier import S3Tier

__all__ = ["S3Address", "S3Tier", "parse_s3_url"]

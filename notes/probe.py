"""Scratch probe for notes/nats-accounts.conf: legit flows work, both tricks of issue 36 land nowhere."""
import asyncio, json, os, subprocess, sys, tempfile, time, socket
from pathlib import Path
import nats
from nats.js.api import StreamConfig, RetentionPolicy

ROLES = ("runner", "gateway", "inference", "relay", "trainer", "admin")
def var(r): return "TURNSTILE_NATS_ADMIN_PASSWORD" if r == "admin" else f"TURNSTILE_{r.upper()}_PASSWORD"
def free():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

async def main(binary: str, conf: str) -> None:
    d = Path(tempfile.mkdtemp())
    text = Path(conf).read_text().replace('store_dir: "/data/jetstream"', f'store_dir: "{d}/js"')
    (d / "n.conf").write_text(text)
    port = free()
    env = {**os.environ, **{var(r): r + "pw" for r in ROLES}}
    p = subprocess.Popen([binary, "-c", str(d / "n.conf"), "-a", "127.0.0.1", "-p", str(port), "-m", str(free()), "-l", str(d / "log")], env=env)
    try:
        while not ((d / "log").exists() and "Server is ready" in (d / "log").read_text()):
            assert p.poll() is None, "server refused config"; time.sleep(0.05)
        errs = {r: [] for r in ROLES}
        async def conn(r):
            async def cb(e): errs[r].append(str(e))
            return await nats.connect(f"nats://{r}:{r}pw@127.0.0.1:{port}", error_cb=cb, inbox_prefix=("_INBOX" if r == "admin" else f"_INBOX_{r}"), allow_reconnect=False)
        c = {r: await conn(r) for r in ROLES}
        js = {r: c[r].jetstream(prefix=f"JS.{r}.API") for r in ("runner", "relay", "trainer")}
        js["admin"] = c["admin"].jetstream()
        await js["runner"].add_stream(StreamConfig(name="TASKS", subjects=["tasks.>"], retention=RetentionPolicy.WORK_QUEUE))
        await js["relay"].add_stream(StreamConfig(name="BATCHES", subjects=["batches.>"]))
        await js["trainer"].add_stream(StreamConfig(name="POLICY_VERSIONS", subjects=["policy.*.versions"], max_msgs_per_subject=1))
        # inference answers with 3 messages (2 heartbeats + reply)
        async def answer(m):
            for i in range(3): await c["inference"].publish(m.reply, f"part{i}".encode())
        await c["inference"].subscribe("llm.*.requests", queue="inference", cb=answer)
        await c["inference"].subscribe("llm.*.requests.*", cb=answer)
        heard = []
        async def on_version(m): heard.append(m.data)
        await c["inference"].subscribe("policy.*.versions", cb=on_version)
        await c["inference"].flush()
        for r in ("runner", "gateway", "admin"):
            inbox = c[r].new_inbox(); sub = await c[r].subscribe(inbox); await c[r].flush()
            await c[r].publish("llm.demo.requests", b"q", reply=inbox)
            got = [(await sub.next_msg(timeout=5)).data for _ in range(3)]
            print(r, "llm reply", got)
            inbox = c[r].new_inbox(); sub = await c[r].subscribe(inbox); await c[r].flush()
            await c[r].publish("llm.demo.requests.c1", b"q", reply=inbox)
            print(r, "sticky reply", (await sub.next_msg(timeout=5)).data)
        # tasks: publish, pull, ack
        ack = await js["runner"].publish("tasks.demo", b"task1"); print("task stored", ack.seq)
        ps = await js["runner"].pull_subscribe("tasks.demo", durable="runners-demo", stream="TASKS")
        [m] = await ps.fetch(1, timeout=5); print("pulled", m.data, m.reply); await m.ack_sync()
        await js["runner"].publish("tasks.demo", b"t2"); await js["runner"].publish("tasks.demo", b"t3")
        ms = await ps.fetch(2, timeout=5); print("pulled batch", [x.data for x in ms])
        for x in ms: await x.ack()
        # batches: relay publishes, trainer pulls and acks
        await js["relay"].publish("batches.demo", b"batch1")
        bs = await js["trainer"].pull_subscribe("batches.demo", durable="trainer-demo", stream="BATCHES")
        [b] = await bs.fetch(1, timeout=5); print("trainer pulled", b.data); await b.ack_sync()
        # object store: relay puts, trainer gets
        try:
            os_r = await js["relay"].create_object_store("BATCH_PAYLOADS")
        except Exception as e:
            print("relay create_object_store", repr(e)); os_r = await js["admin"].create_object_store("BATCH_PAYLOADS")
        os_r = await js["relay"].object_store("BATCH_PAYLOADS")
        await os_r.put("o1", b"x" * 300000)
        os_t = await js["trainer"].object_store("BATCH_PAYLOADS")
        res = await os_t.get("o1"); print("trainer object get", len(res.data))
        # versions: trainer publishes, inference hears, stream keeps
        await c["trainer"].publish("policy.demo.versions", b"v1"); await c["trainer"].flush()
        for _ in range(100):
            if heard: break
            await asyncio.sleep(0.05)
        print("inference heard", heard)
        info = await js["admin"].stream_info("POLICY_VERSIONS"); print("POLICY_VERSIONS msgs", info.state.messages)
        # ---- the tricks ----
        heard.clear()
        vsub = await c["admin"].subscribe("policy.demo.versions"); await c["admin"].flush()
        await js["runner"].publish("tasks.demo", b'{"forged": 2147483647}')
        await c["runner"].publish("JS.runner.API.CONSUMER.MSG.NEXT.TASKS.runners-demo", b'{"batch": 1}', reply="policy.demo.versions")
        await c["runner"].publish("JS.runner.API.STREAM.INFO.TASKS", b"", reply="batches.demo")
        await c["runner"].publish("$JS.API.STREAM.INFO.TASKS", b"", reply="batches.demo")
        await c["runner"].flush(); await asyncio.sleep(1)
        print("inference heard after tricks", heard)
        try:
            x = await vsub.next_msg(timeout=0.5); print("ADMIN HEARD", x.data)
        except nats.errors.TimeoutError: print("admin heard nothing on policy.demo.versions")
        info = await js["admin"].stream_info("BATCHES", subjects_filter="batches.demo"); print("BATCHES batches.demo", info.state.subjects)
        info = await js["admin"].stream_info("TASKS"); print("TASKS msgs (forged consumed by the pull?)", info.state.messages)
        for r in ROLES: print(r, "errors", errs[r])
    finally:
        p.terminate(); p.wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))

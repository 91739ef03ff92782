// The official 2captcha JavaScript client (@2captcha/captcha-solver), unmodified and at its
// defaults, with a plan's worth of tasks in flight on one relay key: $RELAY_TASKS Turnstile
// tasks at once, each polled by the SDK every 5 s (it polls even when a pingback is set) — 40
// res.php reads a second for 200 tasks, twice the relay's per-key read budget. What the relay
// answers over its budget must be something the SDK takes as "not ready yet": every task must
// finish. Driven by local/tests/it/sdk.rs. Environment: RELAY_BASE, RELAY_KEY, RELAY_TASKS,
// NODE_EXTRA_CA_CERTS. Prints one JSON object.
const { Solver } = require("@2captcha/captcha-solver");

const base = process.env.RELAY_BASE;
const solver = new Solver(process.env.RELAY_KEY);
Object.defineProperty(solver, "in", { value: `${base}/in.php` });
Object.defineProperty(solver, "res", { value: `${base}/res.php` });
const n = Number(process.env.RELAY_TASKS || "200");

(async () => {
  const started = Date.now();
  const out = { solved: {}, errors: {}, seconds: [] };
  await Promise.all(
    Array.from({ length: n }, async (_, i) => {
      const t0 = Date.now();
      try {
        const r = await solver.cloudflareTurnstile({ sitekey: "0x4AAAAAAAVrOwQWPlm3Bnr5", pageurl: `https://shop.example/p${i}` });
        out.solved[`t${i}`] = { id: String(r.id), code: r.data };
        out.seconds.push((Date.now() - t0) / 1000);
      } catch (e) {
        out.errors[`t${i}`] = `${e && e.name}: ${e && e.err ? e.err : e && e.message}`;
      }
    }),
  );
  out.wall_seconds = (Date.now() - started) / 1000;
  process.stdout.write(JSON.stringify(out));
})();

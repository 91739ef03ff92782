// The official 2captcha JavaScript client (@2captcha/captcha-solver, pinned in package-lock.json),
// unmodified, against the relay. The package has no `server` option (its hosts are constants),
// so pointing it at the relay takes two lines on the instance: `in` and `res` below. Driven by
// local/tests/it/sdk.rs. Environment: RELAY_BASE (https://host:port), RELAY_KEY, RELAY_IMAGE,
// NODE_EXTRA_CA_CERTS (the relay's local CA). Prints one JSON object.
const fs = require("fs");
const { Solver } = require("@2captcha/captcha-solver");

const base = process.env.RELAY_BASE;
const solver = new Solver(process.env.RELAY_KEY);
Object.defineProperty(solver, "in", { value: `${base}/in.php` });
Object.defineProperty(solver, "res", { value: `${base}/res.php` });

const page = "https://shop.example/login";
// The user agent an Enterprise token is to be used with: sent, and handed back beside the token.
const ua = "Mozilla/5.0 (X11; Linux x86_64) relay-sdk-test/1.0";
const image = fs.readFileSync(process.env.RELAY_IMAGE, "base64");
const jobs = {
  recaptcha_v2: () => solver.recaptcha({ googlekey: "6LfD3PIbAAAAAJs_eEHvoOl75_83eXSqpPSRFJ_u", pageurl: page }),
  recaptcha_v3: () => solver.recaptcha({ googlekey: "6LfB5_IbAAAAAMCtsjEHEHKqcB9iQocwwxTiihJu", pageurl: page, version: "v3", action: "verify", min_score: 0.7 }),
  recaptcha_enterprise: () => solver.recaptcha({ googlekey: "6Lf26sUnAAAAAIKLuWNYgRsFUfmI-3Lex3xT5N-s", pageurl: page, enterprise: 1, userAgent: ua }),
  geetest: () => solver.geetest({ gt: "81388ea1fc187e0c335c0a8907ff2625", challenge: "2e2f0f65240058b683cb6ea21c303eea", pageurl: page }),
  turnstile: () => solver.cloudflareTurnstile({ sitekey: "0x4AAAAAAAVrOwQWPlm3Bnr5", pageurl: page }),
  image: () => solver.imageCaptcha({ body: image, numeric: 1 }),
};

(async () => {
  const out = { solved: {}, errors: {} };
  await Promise.all(
    Object.entries(jobs).map(async ([name, job]) => {
      try {
        const r = await job();
        // A GeeTest answer comes as the JSON object 2captcha sends; the rest as text.
        const code = typeof r.data === "string" ? r.data : JSON.stringify(r.data);
        out.solved[name] = { id: String(r.id), code, user_agent: r.user_agent };
      } catch (e) {
        // The SDK's APIError keeps the server's code in `err` and its own text in `message`.
        out.errors[name] = `${e && e.name}: ${e && e.err ? e.err : e && e.message}`;
      }
    }),
  );
  out.balance = await solver.balance();
  const some = out.solved.turnstile || Object.values(out.solved)[0];
  if (some) {
    out.report_good = await solver.goodReport(some.id);
    out.report_bad = await solver.badReport(some.id);
  }
  try {
    const wrong = new Solver("not-a-relay-key");
    Object.defineProperty(wrong, "in", { value: `${base}/in.php` });
    await wrong.cloudflareTurnstile({ sitekey: "0x4AAAAAAAVrOwQWPlm3Bnr5", pageurl: page });
    out.wrong_key = "no exception";
  } catch (e) {
    out.wrong_key = `${e && e.name}: ${e && e.err ? e.err : e && e.message}`;
  }
  process.stdout.write(JSON.stringify(out));
})();

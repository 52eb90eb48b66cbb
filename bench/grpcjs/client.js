'use strict';
/*
 * A closed-loop grpc-js client for bench/bench_hedge.py (one fresh process per run).
 *
 *   node bench/grpcjs/client.js --target 127.0.0.1:PORT --method /bench.Svc/Get \
 *     --requests 1000 --concurrency 20 [--warmup 200] [--service-config JSON]
 *
 * Sends --warmup calls, then --requests calls with --concurrency workers, each
 * sending its next call when the previous one ends (as drive() in bench_hedge.py).
 * Calls are generic unary calls of raw bytes (identity serializers), without a
 * deadline (the Python gRPC rows set none either). --service-config is passed as
 * the channel option grpc.service_config; retries (and hedging) are on unless
 * grpc.enable_retries is 0, and this client sets it to 1.
 *
 * The server's attempt counter (/bench.Svc/Count) is read on a separate channel
 * without a service config, right before and right after the measured calls.
 * Prints one JSON object on stdout: latencies (seconds), the attempts the server
 * saw during them, client CPU per call (µs, user + system over the whole process)
 * and completed calls per second. Exits 1 if any call fails.
 */

const grpc = require('@grpc/grpc-js');
// The package has no "exports" map, so its package.json can be required.
const GRPC_JS_VERSION = require('@grpc/grpc-js/package.json').version;

const COUNT = '/bench.Svc/Count';
const REQUEST = Buffer.from('k');
const identity = (b) => b;

function parseArgs(argv) {
  const args = { warmup: '200', concurrency: '20', requests: '1000', serviceConfig: null };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, '').replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    if (!(key in args) && !['target', 'method'].includes(key)) {
      throw new Error(`unknown option ${argv[i]}`);
    }
    args[key] = argv[i + 1];
  }
  if (!args.target || !args.method) {
    throw new Error('--target and --method are required');
  }
  return {
    target: args.target,
    method: args.method,
    requests: Number.parseInt(args.requests, 10),
    concurrency: Number.parseInt(args.concurrency, 10),
    warmup: Number.parseInt(args.warmup, 10),
    serviceConfig: args.serviceConfig,
  };
}

function unary(client, method) {
  return new Promise((resolve, reject) => {
    client.makeUnaryRequest(method, identity, identity, REQUEST, (err, value) =>
      err ? reject(err) : resolve(value)
    );
  });
}

function waitForReady(client) {
  return new Promise((resolve, reject) => {
    client.waitForReady(Date.now() + 10000, (err) => (err ? reject(err) : resolve()));
  });
}

async function serverAttempts(counter) {
  return Number.parseInt((await unary(counter, COUNT)).toString(), 10);
}

/* Latencies (seconds) of `requests` calls, `concurrency` workers in a closed loop. */
async function drive(client, method, requests, concurrency) {
  const latencies = [];
  let left = requests;
  async function worker() {
    while (left > 0) {
      left -= 1;
      const t0 = process.hrtime.bigint();
      await unary(client, method);
      latencies.push(Number(process.hrtime.bigint() - t0) / 1e9);
    }
  }
  await Promise.all(Array.from({ length: concurrency }, worker));
  return latencies;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const options = { 'grpc.enable_retries': 1 };
  if (args.serviceConfig) {
    options['grpc.service_config'] = args.serviceConfig;
  }
  const insecure = grpc.credentials.createInsecure();
  const client = new grpc.Client(args.target, insecure, options);
  const counter = new grpc.Client(args.target, insecure, {});
  try {
    await Promise.all([waitForReady(client), waitForReady(counter)]);
    if (args.warmup > 0) {
      await drive(client, args.method, args.warmup, args.concurrency);
    }
    const before = await serverAttempts(counter);
    const cpu = process.cpuUsage();
    const wall = process.hrtime.bigint();
    const latencies = await drive(client, args.method, args.requests, args.concurrency);
    const seconds = Number(process.hrtime.bigint() - wall) / 1e9;
    const used = process.cpuUsage(cpu);
    const attempts = (await serverAttempts(counter)) - before;
    process.stdout.write(
      JSON.stringify({
        client: `grpc-js ${GRPC_JS_VERSION}`,
        node: process.version,
        latencies,
        attempts,
        cpu_us: (used.user + used.system) / args.requests,
        rps: args.requests / seconds,
      }) + '\n'
    );
  } finally {
    client.close();
    counter.close();
  }
}

main().catch((err) => {
  process.stderr.write(`grpc-js client failed: ${err && err.stack ? err.stack : err}\n`);
  process.exitCode = 1;
});

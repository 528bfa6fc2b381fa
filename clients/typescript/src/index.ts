/**
 * The rollout-trace agent server from TypeScript: a Connect client of AgentService over gRPC,
 * and the google.rpc.ErrorInfo every error of the server carries.
 */
import { type Client, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

import { type ErrorInfo, ErrorInfoSchema } from "./gen/google/rpc/error_details_pb.js";
import { AgentService } from "./gen/rollout/agent/v1/agent_pb.js";

export * from "./gen/rollout/agent/v1/agent_pb.js";
export { type ErrorInfo, ErrorInfoSchema } from "./gen/google/rpc/error_details_pb.js";

export interface AgentConnectionOptions {
  /** Sent as `authorization: Bearer <token>` (for a server run with --auth-token-env). */
  token?: string;
  /** Connect with TLS; `ca` is the PEM of the certificates to trust (default: the system's). */
  tls?: boolean;
  ca?: string;
}

/** A client of AgentService and the HTTP/2 connection it runs on. */
export interface AgentConnection {
  client: Client<typeof AgentService>;
  /** Close the connection; a program that does not would keep running. */
  close(): void;
}

/** Connect to an agent server at HOST:PORT (e.g. "127.0.0.1:50051"). */
export function connectAgent(address: string, options: AgentConnectionOptions = {}): AgentConnection {
  const tls = options.tls ?? options.ca !== undefined;
  const baseUrl = `${tls ? "https" : "http"}://${address}`;
  const sessionManager = new Http2SessionManager(baseUrl, undefined, options.ca ? { ca: options.ca } : undefined);
  const interceptors: Interceptor[] = [];
  const token = options.token;
  if (token) {
    interceptors.push((next) => (request) => {
      request.header.set("authorization", `Bearer ${token}`);
      return next(request);
    });
  }
  const transport = createGrpcTransport({ baseUrl, sessionManager, interceptors });
  return {
    client: createClient(AgentService, transport),
    close: () => sessionManager.abort(),
  };
}

/** The ErrorInfo of a failed call (its UPPER_SNAKE `reason`, `domain` and `metadata`). */
export function errorInfo(error: unknown): ErrorInfo | undefined {
  return ConnectError.from(error).findDetails(ErrorInfoSchema)[0];
}

// echo_server PORT: grpcfloor.Echo/Echo on 127.0.0.1:PORT with grpc++'s sync server (its own thread
// pool); each answer is the first n bytes of the request's data, n its first 4 bytes.
#include <cstdint>
#include <cstring>
#include <string>

#include <grpcpp/grpcpp.h>

#include "echo.grpc.pb.h"

namespace {

class EchoService final : public grpcfloor::Echo::Service {
  grpc::Status Echo(grpc::ServerContext*, const grpcfloor::Blob* request, grpcfloor::Blob* answer) override {
    const std::string& data = request->data();
    uint32_t n = 0;
    if (data.size() < sizeof n) return {grpc::StatusCode::INVALID_ARGUMENT, "a request holds 4 bytes or more"};
    std::memcpy(&n, data.data(), sizeof n);  // little-endian hosts only, as the benchmark's
    if (n > data.size()) return {grpc::StatusCode::INVALID_ARGUMENT, "an answer is at most the request"};
    answer->set_data(data.data(), n);
    return grpc::Status::OK;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s PORT\n", argv[0]);
    return 2;
  }
  EchoService service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(std::string("127.0.0.1:") + argv[1], grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) return 1;
  server->Wait();
}

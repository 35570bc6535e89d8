// echo_client PORT SIZE ANSWER ITERS: ITERS calls of grpcfloor.Echo/Echo on 127.0.0.1:PORT, one in
// flight, each carrying SIZE bytes and asking ANSWER back (checked); prints "p50 p99" in ms.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "echo.grpc.pb.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s PORT SIZE ANSWER ITERS\n", argv[0]);
    return 2;
  }
  const size_t size = std::strtoul(argv[2], nullptr, 10);
  const uint32_t answer = std::strtoul(argv[3], nullptr, 10);
  const int iters = std::atoi(argv[4]), warmup = 200;
  if (size < 4 || answer > size || iters < 1) {
    std::fprintf(stderr, "SIZE >= 4, ANSWER <= SIZE, ITERS >= 1\n");
    return 2;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(std::string("127.0.0.1:") + argv[1], grpc::InsecureChannelCredentials(), args);
  auto stub = grpcfloor::Echo::NewStub(channel);

  grpcfloor::Blob request;
  std::string data(size, '\0');
  std::mt19937 rng(0);
  for (char& c : data) c = static_cast<char>(rng());
  std::memcpy(data.data(), &answer, sizeof answer);
  request.set_data(data);

  std::vector<double> ms;
  for (int i = 0; i < warmup + iters; ++i) {
    grpc::ClientContext context;
    grpcfloor::Blob reply;
    const auto t = std::chrono::steady_clock::now();
    const grpc::Status status = stub->Echo(&context, request, &reply);
    const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
    if (!status.ok()) {
      std::fprintf(stderr, "call failed: %s\n", status.error_message().c_str());
      return 1;
    }
    if (i == 0 && reply.data() != data.substr(0, answer)) {
      std::fprintf(stderr, "the echo server answered %zu B wrongly\n", size);
      return 1;
    }
    if (i >= warmup) ms.push_back(dt);
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%.3f %.3f\n", ms[ms.size() / 2], ms[static_cast<size_t>(ms.size() * 0.99)]);
}

// The .npy writer and the base64 encoder. The byte-level checks run here; tests/check_npy.py then
// has numpy read back the files this test writes (when given a directory) bit-exact.
#include "../support/small_replay.hpp"

#include <routing_replay/npy.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace rr = routing_replay;

TEST_CASE("base64 follows RFC 4648 test vectors")
{
  CHECK(rr::base64_encode("") == "");
  CHECK(rr::base64_encode("f") == "Zg==");
  CHECK(rr::base64_encode("fo") == "Zm8=");
  CHECK(rr::base64_encode("foo") == "Zm9v");
  CHECK(rr::base64_encode("foob") == "Zm9vYg==");
  CHECK(rr::base64_encode("fooba") == "Zm9vYmE=");
  CHECK(rr::base64_encode("foobar") == "Zm9vYmFy");
  CHECK(rr::base64_encode(std::string{"\xff\x00\x80", 3}) == "/wCA");
}

TEST_CASE("the .npy header is version 1.0, 64-byte aligned, little-endian, C order")
{
  const std::vector<std::int16_t> data = {1, -1, 300, 4, 5, 6};
  const std::int64_t shape[]           = {1, 3, 2};
  const std::string npy                = rr::to_npy<std::int16_t>(data, shape);
  REQUIRE(npy.size() > 10);
  CHECK(npy.compare(0, 6, "\x93NUMPY") == 0);
  CHECK(npy[6] == 1);
  CHECK(npy[7] == 0);
  const auto header_len = static_cast<unsigned char>(npy[8]) | (static_cast<unsigned char>(npy[9]) << 8);
  CHECK((10 + header_len) % 64 == 0);
  const std::string header = npy.substr(10, static_cast<std::size_t>(header_len));
  CHECK(header == std::string{"{'descr': '<i2', 'fortran_order': False, 'shape': (1, 3, 2), }"} +
                    std::string(static_cast<std::size_t>(header_len) - 63, ' ') + "\n");
  CHECK(npy.size() == 10 + static_cast<std::size_t>(header_len) + data.size() * 2);
  const std::int64_t one_dim[] = {6};
  CHECK(rr::to_npy<std::int16_t>(data, one_dim).find("'shape': (6,)") != std::string::npos);
  const std::int64_t wrong[] = {4};
  CHECK_THROWS_AS(rr::to_npy<std::int16_t>(data, wrong), rr::error);
}

namespace {

template <class Index>
void write_sample(const std::filesystem::path& dir, const std::string& name)
{
  using replay = rr::RoutingReplay<rr::host_backend, Index>;
  rr_test::small_replay<replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  for (std::int64_t first = 0; first < 6; first += 3) {
    slots = {first, first + 1, first + 2};
    rr::step_plan plan;
    plan.schedule({1, first, 3, 0, slots});
    s.step(plan, first);
  }
  const auto rows = s.rr().extract(1);
  rr::write_npy((dir / (name + ".npy")).string(), rows);
  std::ofstream{dir / (name + ".b64")} << rr::to_base64_npy(rows);
  // what numpy must read: the flat ids as text, one per line
  std::ofstream expected{dir / (name + ".txt")};
  expected << rows.num_rows() << ' ' << rows.num_layers() << ' ' << rows.top_k() << '\n';
  for (const Index v : rows.flat()) { expected << +v << '\n'; }
}

}  // namespace

TEST_CASE("extractions written as .npy and base64 .npy for every index type")
{
  const char* dir = std::getenv("ROUTING_REPLAY_NPY_DIR");
  const std::filesystem::path out = dir != nullptr ? dir : std::filesystem::temp_directory_path() / "rr_npy";
  std::filesystem::create_directories(out);
  write_sample<std::uint8_t>(out, "uint8");
  write_sample<std::uint16_t>(out, "uint16");
  write_sample<std::int16_t>(out, "int16");
  write_sample<std::int32_t>(out, "int32");
  CHECK(std::filesystem::file_size(out / "int16.npy") == 128 + 6 * 2 * 2 * 2);
}

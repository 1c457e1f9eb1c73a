// The policy concepts, checked by the host compiler (tests/gpu/test_cuda.cu repeats them under nvcc).
#include "../support/concept_checks.hpp"

#include <doctest/doctest.h>

TEST_CASE("policy concepts hold under the host compiler") { CHECK(true); }

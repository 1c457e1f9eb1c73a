/// @file
/// Everything an engine built with nvcc includes: RoutingReplay, the policies and both backends.
#pragma once

#include <routing_replay/cuda_backend.cuh>
#include <routing_replay/routing_replay.hpp>

"""Memory managers (issue 8): reserve rule, composable memory resources, config, manager, tracker."""

"""The admission queue: requests that no worker can take now wait here, in an order shared by
every frontend process (priority bands, fair between tenants, arrival order), until their own
frontend dispatches them. Redis plumbing only: imported by the frontend's serving layer."""
